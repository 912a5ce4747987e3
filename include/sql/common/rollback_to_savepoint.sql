-- Dry run: undo the batch's writes, keep its row locks until the batch ends.
ROLLBACK TO SAVEPOINT pin_dry_run
