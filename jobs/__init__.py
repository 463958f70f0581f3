"""Thin Ray job entry points that own their job configs: one per stage, the flywheel's jobs, and the demos."""
