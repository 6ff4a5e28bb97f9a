"""``GET /longreach`` on a ``vllm serve``: what the served model's attention runs, so that a client
(``longreach eval --server``) records the method the server runs rather than what its label claims.

vLLM's endpoint plugins (``vllm.endpoint_plugins``) add routes to its OpenAI-compatible server; they are opt-in:
vLLM loads one only when ``VLLM_PLUGINS`` names it. ``VLLM_PLUGINS=longreach vllm serve ...`` loads both of
longreach's plugins (this one and the attention backends of :mod:`.vllm`, registered under the same name). The
answer is read from the server's own model config, where ``--hf-overrides`` has put the record:

    {"longreach": <the record, or null>, "method": "string(shift=5461, local_window=128, mscale=False) [L=8192]"}
"""

# no "from __future__ import annotations": FastAPI reads the route's annotation (Request) as an object

from .transformers import CONFIG_KEY
from .vllm_record import resolve

ROUTE = "/longreach"
STOCK = "rope: vLLM's own attention (no longreach record)"


def served(hf_config) -> dict:
    """What ``GET /longreach`` answers for a model config: its record, and the methods it runs described."""
    record = getattr(hf_config, CONFIG_KEY, None)
    if not record:
        return {CONFIG_KEY: None, "method": STOCK}
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    window = int(record.get("training_window") or text.max_position_embeddings)
    position, frequency, drop = resolve(record, window)
    described = " + ".join(x.describe() for x in (position, frequency, drop) if x is not None)
    return {CONFIG_KEY: record, "method": f"{described} [L={window}]"}


class ServedMethod:
    """The endpoint plugin (:class:`vllm.plugins.endpoint_plugins.interface.EndpointPlugin`): its route, and the
    answer read once from the engine's config as the server starts."""

    name = "longreach"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from fastapi import Request

        @app.get(ROUTE)
        async def answer(request: Request) -> dict:
            return request.app.state.longreach

    async def init_state(self, engine_client, state, args) -> None:
        state.longreach = served(engine_client.vllm_config.model_config.hf_config)
