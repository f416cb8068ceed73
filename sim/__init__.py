"""A discrete-event simulator of the app at scales real engines here cannot reach: modelled engines and hand-offs,
the app's own mode policy deciding (app/policy/mode_policy.py), on a virtual clock."""
