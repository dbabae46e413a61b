"""The engine: the dispatcher thread and the parts it composes (``dispatcher`` lists them and
who owns what). Everything here runs on the dispatcher thread except ``source``'s feeders; the
scheduling decisions themselves are pure and live in ``xshare.sched``."""
