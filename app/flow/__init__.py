"""How a request's legs travel once its mode is chosen: dispatched to replicas by load (routing, replica_view), the
first token seeded from prefill (first_token), retried when a replica dies (request_flow), every phase stamped
(timeline)."""
