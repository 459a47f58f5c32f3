"""The OpenAI-compatible HTTP server of eagle_jax (FastAPI + uvicorn); the engine is eagle_jax.serving."""
