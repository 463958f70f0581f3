"""OpenAI-compatible serving: config, protocol (typed models), service + app (FastAPI, no Ray), deployment (Ray Serve)."""
