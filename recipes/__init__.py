"""Single-process drivers over the library for machines without Ray: the GPU recipes, the learning curve."""
