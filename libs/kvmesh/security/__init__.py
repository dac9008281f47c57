"""Who is calling and what it may do: identities, roles, the authorisation table, tokens and certificates.

See ``docs/security.md`` (threat model, the RPC/route × role table, token and certificate formats).
"""
