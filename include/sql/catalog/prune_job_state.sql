-- The scores inherited at the first nights (pin_nightly.popularity_inherited) and the cards
-- remembered as skipped (pin_nightly.popularity_skipped_card) whose night is past retention's
-- horizon (the nightly window is never less than 30 days, as for the partitions): no window
-- of this date or a later one adds them any more.
-- name: prune_inherited
DELETE FROM pin_nightly.popularity_inherited
 WHERE as_of < %(as_of)s::date - (greatest(%(keep_days)s, 30) + 2)

-- name: prune_skipped
DELETE FROM pin_nightly.popularity_skipped_card
 WHERE as_of < %(as_of)s::date - (greatest(%(keep_days)s, 30) + 2)
