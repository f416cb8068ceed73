"""The front of the app: the Serve deployment that takes OpenAI requests over HTTP and handle calls (server), the
request schema it accepts (openai_protocol) and the metrics it exports (metrics)."""
