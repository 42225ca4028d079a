"""A backend module that fails at import with something other than ImportError (a config check,
a missing environment variable): one backend's problem, never the whole command's."""

raise RuntimeError("MY_BACKEND_HOME is not set")
