"""vLLM as a rollout engine (engine.py); the server it talks to runs vLLM's own engine in
its own environment (server/, .venv-vllm). Nothing here imports vllm."""
