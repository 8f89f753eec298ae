"""dmuon-server: a job controller that launches DMuon training and streams its metrics."""
