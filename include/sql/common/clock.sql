-- The job's "today" (common/today): what the date of a run is checked against, before it writes
-- anything and without reading a job-owned table (a fresh install has none yet).
SELECT {common/today}
