SELECT to_regclass(%(relation)s) IS NOT NULL
