"""The kvhandoff server: one model family behind OpenAI's HTTP API, with conversations handed over between models
by mapping their KV cache instead of re-prefilling it (docs/SERVING.md).

Modules: `protocol` (request/response models in OpenAI's shapes), `engine` (sessions, model workers, handoff
decisions, decoding; no HTTP), `guard` (the quality guard and its measurement on dev conversations), `metrics`
(the Prometheus registry), `family` (loading the hosted models and mappers), `app` (`create_app(engine)`: the
routes), `server` (`run_server(models, mappers, config)`: the engine behind uvicorn).
"""
