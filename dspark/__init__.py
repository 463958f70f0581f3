"""dspark: train and serve speculative-decoding drafters (DSpark, DFlash, Eagle3). The library, grouped by
concern — decoding, models, drafters, training, data, eval, io, serve, export, devstack — runs in a plain
process; Ray, MLflow and S3 live at the edges (pipelines/, jobs/, dspark/io)."""
