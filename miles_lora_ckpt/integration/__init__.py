"""Miles integration: the init hook's work, the Miles shapes it binds to, and resume with the same command.

Nothing here imports Miles at module level: the hook imports whatever Miles runs it.
"""
