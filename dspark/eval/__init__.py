"""Evaluation: benchmark files, decoding prompts target-only and with drafters, acceptance metrics and their
intervals, calibration, reports and the next-step planner."""
