"""Copies of a zone's prefix index kept from `CacheManagerService.WatchIndex`: `index` (`ReplicaIndex`), `follower`
(the one WatchIndex follower: the router's replica, a cache-manager's followed zones), `shared` (one replica for
the router processes of a host, in shared memory) and `media` (a match's GPU run and tier part)."""
