"""Utilities every layer may use, and that use nothing of the package: the user-error family and exit
codes (`errors`), atomic writes that follow the umask (`files`), stage lines and progress bars (`progress`), what
one process keeps between the jobs of a sweep (`memo`)."""
