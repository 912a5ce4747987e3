-- A uuid v7 of this instant, as an expression put in place of the uuid7_now placeholder where
-- it is used (the popularity snapshots, the benchmark floor, the hot path new comments). RFC 9562
-- layout, the unix milliseconds of clock_timestamp() in the first 48 bits, then the version
-- and variant bits over the random bits of a v4. Ids written in time order go to the right
-- edge of their primary key's index instead of one random leaf page each.
encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING substring(
    int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
    FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
