"""Ray Data and actor pools only: the synthesize and generate stages, worker pools, the decode of evaluate/calibrate."""
