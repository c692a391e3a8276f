"""Evaluation: strict parsing, ranking/structural metrics, repair, baselines, reports.

Modules (import the one you need; nothing is re-exported so that serving can import the
parser without pulling in numpy or matplotlib):

* ``parse``     completion text/tokens -> ``ParsedRanking`` with every defect counted
* ``metrics``   recall@k, NDCG@k, MRR and structural failure rates
* ``repair``    explicit, counted repair to a full permutation (serving)
* ``scoring``   strict (retriever fallback) and repaired metrics for a batch
* ``baselines`` retriever, popularity and seeded random rankings
* ``report``    results tables as JSON, Markdown, CSV and a PNG chart
"""
