"""The OpenAI-compatible server (chapter A3): ``python -m minillm serve --model smollm2-135m``.

``api`` is the FastAPI app (endpoints, error bodies), ``loop`` the one thread that owns and
steps the engine, ``protocol`` the request bodies, ``responses`` the response bodies and stream
chunks, ``metrics`` the Prometheus metrics. Importing this package needs fastapi and
prometheus-client; ``minillm`` itself does not import it.
"""
from .api import APIError, Server, create_app
from .loop import EngineLoop, EngineStopped, Job, QueueFull
from .metrics import ServerMetrics

__all__ = ["APIError", "EngineLoop", "EngineStopped", "Job", "QueueFull", "Server",
           "ServerMetrics", "create_app"]
