"""Edges to the outside world: object storage (local paths and s3://), MLflow tracking, drafter references."""
