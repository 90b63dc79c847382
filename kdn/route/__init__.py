"""``kdn route``: an OpenAI-compatible front for N inference hosts that sends each request to the
host where its KV is cheapest to have.

For each request the router tokenizes once as the engine does (:mod:`kdn.route.openai`), computes
the chain keys, asks every host's edge where each chunk is (its own tiers, a peer edge, the
origin: :mod:`kdn.route.edges`), and prices each host by expected time to first token — queue,
prefill at the host's measured rate, fetch at the tier's measured link rate or recompute, whichever
is cheaper (:mod:`kdn.route.score`, rates in :mod:`kdn.route.rates`). A policy picks
(:mod:`kdn.route.policy`: ``cost``, and ``prefix_overlap`` and ``round_robin`` to compare with).

Parts: :mod:`kdn.route.router` (the scorer as a library call: :meth:`Router.plan`; health and
rates), :mod:`kdn.route.app` (the HTTP front), :mod:`kdn.route.hosts` (a host's state),
:mod:`kdn.route.config`, :mod:`kdn.route.cli` (the command). The router holds no state it cannot
rebuild: health, rates and its record of what it sent where are all re-measured after a restart.
"""
