"""Edges to the outside world: `tracking/` (every MLflow call: runs, metrics, the model registry, lineage) and
`storage/` (object storage: local paths and s3://, the rollout store, training-run directories); beside them
drafter references (drafter_source, through both), exit hooks and HTTP health polling."""
