"""One vLLM engine per replica: the Serve deployment that runs it (server), the requests and chunks it exchanges with
the ingress (protocol), and the load it reports for routing (stats)."""
