"""The OpenAI-compatible HTTP gateway: a fourth service, a client of the orchestrator's API.

``specdec serve gateway`` runs it. It speaks OpenAI's HTTP API (completions,
chat completions, models; server-sent events for streaming) and calls the
orchestrator's public gRPC API (``specdec.v1.Orchestrator``) for each request.

Layout: ``app`` (routes and middlewares, thin), ``openai_schema`` (requests
and responses, pure), ``errors`` (gRPC status -> HTTP status and OpenAI's
error JSON, the one mapping), ``upstream`` (the gRPC client), ``service``
(the process: TLS, drain on SIGTERM). Design notes: docs/gateway.md.
"""
