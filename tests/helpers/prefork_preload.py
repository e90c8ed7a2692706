"""What the forkserver of `tests/helpers/prefork.py` imports once, before it forks anything: the
heavy imports of a server, a docs example and a CLI run. Imports only: no thread, no compute, no
file opened (a fork copies this process as it is)."""

import openai  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import uvicorn  # noqa: F401
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig  # noqa: F401

import chatserve.cli  # noqa: F401
import chatserve.engine.async_engine  # noqa: F401
import chatserve.server.app  # noqa: F401
