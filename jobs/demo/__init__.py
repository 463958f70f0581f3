"""The demos: `python -m jobs.demo` (the whole lifecycle on the local stack) and `python -m jobs.demo.flywheel`."""
