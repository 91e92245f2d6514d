"""The path of one proxied request, in the order it is taken:

    handler.py      Proxy: the steps below, in order, for every upstream kind (MCP's too)
    intake.py       route, identity and policy, body, the call's facts, the tenant (once)
    fence.py        the one place that decides where a run's request is fenced
    passthrough.py  forwarded, nothing recorded
    lookup.py       the answer lookup chain: the attempt's journal in memory, the answers held
                    here, a call in flight here, then the claim
    record.py       a won claim's call: its own task, its listeners, its lease
"""
