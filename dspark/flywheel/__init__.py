"""The drafter flywheel: per-domain acceptance of the served drafter, opt-in traffic capture into the
rollout store, drift detection against the drafter's evaluation baseline, and the promotion rule for
a drafter retrained on captured traffic (README "Keeping a drafter fresh")."""
