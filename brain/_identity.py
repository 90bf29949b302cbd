"""With CURVE on, a node's identity is its key: a vector is taken only from the key filed as `<node_id>.key`.

Without CURVE there is no binding: the brain trusts the network, and any sender may claim any node id.
"""

from __future__ import annotations

from prismlb.wire import AuthorizedKeys, NodeVector, SpoofedIdentityError, UnknownKeyError


class IdentityPolicy:
    """The `VectorReceiver` identity check: the vector's node id must be the name of its sender's key file."""

    def __init__(self, keys: AuthorizedKeys) -> None:
        self.keys = keys

    def check(self, vector: NodeVector, user_id: str | None) -> None:
        """Raise unless `user_id` (the sender's Z85 public key, as pyzmq's authenticator names it) is filed
        under `vector.node_id`."""
        owner = self.keys.name_of(user_id) if user_id else None
        if owner is None:
            raise UnknownKeyError(f"vector for {vector.node_id} came over a connection whose key is not authorised")
        if owner != vector.node_id:
            raise SpoofedIdentityError(f"key of {owner} sent a vector claiming node id {vector.node_id}")
