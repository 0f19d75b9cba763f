"""What every engine backend shares: the job contract (`jobs`), the ending rules of a generating
sequence (`endings`), sampling, text assembly (UTF-8, stop strings) and the bounded channels."""
