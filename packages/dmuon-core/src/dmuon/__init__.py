"""DMuon: distributed Muon for PyTorch FSDP2 with dedicated parameter ownership."""
