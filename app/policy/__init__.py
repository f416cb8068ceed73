"""What the ingress decides, as pure logic -- no Ray, no vLLM, no I/O, no clock -- so the simulator (sim/) runs the
same code: which mode a request takes (mode_policy), when it may run or is shed by its service class (admission,
service_class), and how loaded a replica is (load_view)."""
