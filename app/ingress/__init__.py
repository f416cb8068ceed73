"""The front of the app: the Serve deployment that takes OpenAI requests over HTTP and handle calls (server), vLLM's
own OpenAI serving classes it answers them with (serving) over an engine client of the request's legs
(engine_client), the request models and refusals (openai_protocol) and the metrics it exports (metrics)."""
