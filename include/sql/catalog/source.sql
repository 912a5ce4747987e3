SELECT id FROM {cards}
 WHERE status IS DISTINCT FROM 'Delisted'
   AND (NOT %(targeted)s OR id = ANY(%(card_ids)s::uuid[]))
