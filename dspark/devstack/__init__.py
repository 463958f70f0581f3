"""The embedded local stack (SeaweedFS S3, MLflow, Ray head) for laptops and CI; only the CLI and the demo use it."""
