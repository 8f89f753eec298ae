"""The recipe's checkpoints, one concern per module (the state dicts of a dedicated model
themselves come from the library, `dmuon.checkpoint`).

* `dmuon.train.checkpoints.stateful` - what a checkpoint holds: the model, optimizer,
  trainer and RNG state as ``Stateful`` objects.
* `dmuon.train.checkpoints.folder` - where it is held: the ``step_NNNNNNNN`` folders of
  ``--checkpoint-dir``, written atomically, verified, rotated and read back.
* `dmuon.train.checkpoints.manager` - when: `CheckpointManager` resumes a run, saves on
  schedule and on a stop, and exports the model.
"""
