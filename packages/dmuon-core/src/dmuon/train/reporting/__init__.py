"""Where the recipe reports what it does, one concern per module.

* `dmuon.train.reporting.metrics_file` - the metrics file (one JSON line per step), the
  only channel the job service reads.
* `dmuon.train.reporting.console` - the progress bar or lines and the final summary.
* `dmuon.train.reporting.trackers` - TensorBoard, MLflow and Weights & Biases.
* `dmuon.train.reporting.reporters` - `Reporting`, which hands each line to all of them.
* `dmuon.train.reporting.user_metrics` - `log_metrics`, the metrics file written from
  your own script under the job service.
"""
