"""Domain tables and realistic data sets for the demo and the tests (never used by the jobs)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from tools.devenv import run_sql_file

STATUSES = ("Visible", "HiddenByModerator", "DeletedByAuthor")


def uuid7(ts: datetime, rnd: random.Random) -> uuid.UUID:
    """A version 7 uuid for instant ``ts`` (time-ordered), random bits from ``rnd``."""
    ms = int(ts.timestamp() * 1000) & ((1 << 48) - 1)
    value = (
        (ms << 80) | (0x7 << 76) | (rnd.getrandbits(12) << 64) | (0b10 << 62) | rnd.getrandbits(62)
    )
    return uuid.UUID(int=value)


def create_news_schema(dsn: str, indexes: bool = True) -> None:
    run_sql_file(dsn, "schema/news_domain.sql")
    if indexes:
        run_sql_file(dsn, "schema/news_recommended_indexes.sql")


def create_catalog_schema(dsn: str) -> None:
    run_sql_file(dsn, "schema/catalog_domain.sql")


def copy_rows(conn, table: str, columns: Iterable[str], rows: Iterable[tuple]) -> None:
    cols = ", ".join(columns)
    with conn.cursor() as cur, cur.copy(f"COPY {table} ({cols}) FROM STDIN") as cp:
        for row in rows:
            cp.write_row(row)


def load_news_demo(
    dsn: str, posts: int = 5000, seed: int = 7, now: datetime | None = None
) -> dict[str, int]:
    """Posts over the last 60 days (5 % archived), Zipf-like comments (visible, hidden and
    deleted, some changed in the last day), counters kept by a simulated hot path, then ~3 % of
    the counters drifted. Returns what was made."""
    import psycopg

    rnd = random.Random(seed)
    now = now or datetime.now(UTC)
    post_rows, comment_rows = [], []
    drifted = archived = recent = 0
    for i in range(posts):
        created = now - timedelta(days=60) + timedelta(seconds=i * (60 * 86400 // posts))
        pid = uuid7(created, rnd)
        status = "Archived" if rnd.random() < 0.05 else "Published"
        archived += status == "Archived"
        n = 0 if rnd.random() < 0.33 else min(int(rnd.paretovariate(1.2)), 400)
        visible = 0
        for _ in range(n):
            c_created = created + timedelta(seconds=rnd.randint(0, 86400 * 3))
            if c_created > now:
                c_created = now - timedelta(seconds=rnd.randint(1, 3600))
            st = rnd.choices(STATUSES, weights=(85, 10, 5))[0]
            updated = c_created
            if rnd.random() < 0.02:
                updated = now - timedelta(hours=rnd.uniform(0, 20))
                recent += 1
            visible += st == "Visible"
            comment_rows.append((uuid7(c_created, rnd), pid, st, c_created, updated))
        count = visible
        if status != "Archived" and rnd.random() < 0.03:
            count = max(0, visible + rnd.choice((-3, -2, -1, 1, 2, 5)))
            drifted += count != visible
        post_rows.append((pid, status, count, created))
    with psycopg.connect(dsn) as conn:
        copy_rows(conn, "news.posts", ("id", "status", "comments_count", "updated_at"), post_rows)
        copy_rows(
            conn,
            "news.comments",
            ("id", "post_id", "status", "created_at", "updated_at"),
            comment_rows,
        )
        conn.execute("ANALYZE news.posts")
        conn.execute("ANALYZE news.comments")
    return {
        "posts": posts,
        "archived": archived,
        "comments": len(comment_rows),
        "drifted": drifted,
        "comments_changed_recently": recent,
    }


def load_catalog_demo(
    dsn: str,
    as_of,
    property_objects: int = 3000,
    projects: int = 200,
    nights: int = 31,
    seed: int = 11,
) -> dict[str, int]:
    """Cards (85 % Published, 10 % Hidden, 5 % Delisted) with 31 nights of snapshot history
    before ``as_of`` (a few nights missed, as after an outage), today's counters a little
    higher, and two poison cards (NULL and negative counters)."""
    import psycopg

    from tools.devenv import run_sql_file

    run_sql_file(dsn, "schema/catalog_popularity.sql")
    rnd = random.Random(seed)
    missed = {as_of - timedelta(days=d) for d in (9, 17, 18)}
    made = {"cards": 0, "snapshots": 0, "poison": 0}
    with psycopg.connect(dsn) as conn:
        for kind, table, n in (
            ("PropertyObject", "catalog.property_object_cards", property_objects),
            ("Project", "catalog.project_cards", projects),
        ):
            cards, snaps = [], []
            for i in range(n):
                created = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=i)
                cid = uuid7(created, rnd)
                status = rnd.choices(("Published", "Hidden", "Delisted"), (85, 10, 5))[0]
                rate = rnd.paretovariate(1.5) * (20 if kind == "Project" else 3)
                views = rnd.randint(0, 2000)
                for age in range(nights, 0, -1):
                    views += int(rnd.expovariate(1 / rate))
                    night = as_of - timedelta(days=age)
                    if night not in missed:
                        snaps.append((kind, cid, night, views))
                views += int(rnd.expovariate(1 / rate))
                if i < 2 and kind == "PropertyObject":
                    views = None if i == 0 else -1
                    made["poison"] += 1
                cards.append((cid, status, views, 0, created))
            copy_rows(
                conn,
                table,
                ("id", "status", "popularity_views", "popularity_score", "updated_at"),
                cards,
            )
            copy_rows(
                conn,
                "catalog.popularity_daily_views",
                ("card_kind", "card_id", "run_date", "cumulative_views"),
                snaps,
            )
            made["cards"] += n
            made["snapshots"] += len(snaps)
        conn.execute("ANALYZE catalog.popularity_daily_views")
    return made
