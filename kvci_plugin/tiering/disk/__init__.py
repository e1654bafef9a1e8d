"""The disk tier: a blob location and the checkpoint catalog behind one object (``tier``); the
catalog (``catalog``, with its ``schema``, ``records``, ``fences``, ``eviction`` and shared
``sql``) on its database (``db``: SQLite, or PostgreSQL shared by nodes); how its calls wait
(``calls``); and a tier whose dependencies did not answer at start, attached later (``attach``)."""
