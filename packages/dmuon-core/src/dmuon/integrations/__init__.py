"""DMuon in the trainers people already use.

Each module imports its framework only when imported itself:

- `dmuon.integrations.transformers`: `DMuonTrainer`, a ``transformers.Trainer`` that trains
  with `dmuon.Muon`;
- `dmuon.integrations.accelerate`: `prepare`, for a training loop of one's own on
  Accelerate;
- `dmuon.integrations.torchtitan`: the pieces that put DMuon into torchtitan's trainer (its
  parallelize step and its optimizer builder).
"""
