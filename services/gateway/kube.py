"""The gateway's few Kubernetes API calls besides discovery: the client's configuration, the pool
Deployments' `scale` subresource, and leader election through a coordination.k8s.io Lease.

Everything here is synchronous (the `kubernetes` client is); the planner calls it from a thread.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from services.gateway.router import Role

# A pool the planner sizes: the model version its workers serve (NAME@VERSION; None for a gateway of
# one model, whose workers form one group) and its role.
Pool = tuple[str | None, Role]

_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_NOT_FOUND = 404
_CONFLICT = 409


def api_client() -> client.ApiClient:
    """A client for the cluster this runs in (its service account), or else the one of ~/.kube/config."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def current_namespace() -> str:
    """The namespace of this pod: $POD_NAMESPACE, else the service account's, else "default"."""
    if namespace := os.environ.get("POD_NAMESPACE"):
        return namespace
    if _NAMESPACE_FILE.exists():
        return _NAMESPACE_FILE.read_text().strip()
    return "default"


class DeploymentScale:
    """Read and set the replicas of the pools' Deployments through their `scale` subresource."""

    def __init__(self, api: client.AppsV1Api, namespace: str, deployments: Mapping[Pool, str]) -> None:
        """`deployments`: the Deployment holding each pool that may be scaled; other pools are not."""
        self._api = api
        self._namespace = namespace
        self._deployments = dict(deployments)

    def holds(self, pool: Pool) -> bool:
        """Whether a Deployment is known to hold `pool`."""
        return pool in self._deployments

    def replicas(self, pool: Pool) -> int:
        """The pool's desired replica count as the Deployment holds it now."""
        scale = self._api.read_namespaced_deployment_scale(self._deployments[pool], self._namespace)
        return scale.spec.replicas or 0

    def set_replicas(self, pool: Pool, replicas: int) -> None:
        """Ask for `replicas` pods in the pool."""
        self._api.patch_namespaced_deployment_scale(
            self._deployments[pool], self._namespace, {"spec": {"replicas": replicas}}
        )


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LeaseElection:
    """One leader among the gateway replicas, through a Lease that the leader renews.

    The leader is whoever holds the Lease and renewed it within `duration_s`; anyone may take over
    an expired one. Writes carry the Lease's resourceVersion, so of two replicas racing for it the
    API server accepts one and answers the other 409 Conflict.
    """

    def __init__(self, api: client.CoordinationV1Api, namespace: str, name: str, identity: str,
                 duration_s: int, clock: Callable[[], datetime.datetime] = _utc_now) -> None:
        """`clock`: the time written into the Lease and compared with its holder's renewals (UTC;
        Lease times are wall-clock times shared by every replica)."""
        self._api = api
        self._clock = clock
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._duration_s = duration_s

    def try_lead(self) -> bool:
        """Take or renew the Lease; whether this replica leads until the next call."""
        now = self._clock()
        try:
            lease = self._api.read_namespaced_lease(self._name, self._namespace)
        except ApiException as error:
            if error.status != _NOT_FOUND:
                raise
            return self._write(lambda: self._api.create_namespaced_lease(self._namespace, self._new_lease(now)))
        spec = lease.spec
        if spec.holder_identity != self.identity:
            renewed = spec.renew_time or spec.acquire_time
            duration = datetime.timedelta(seconds=spec.lease_duration_seconds or self._duration_s)
            if spec.holder_identity and renewed is not None and renewed + duration > now:
                return False
            spec.holder_identity = self.identity
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.renew_time = now
        spec.lease_duration_seconds = self._duration_s
        return self._write(lambda: self._api.replace_namespaced_lease(self._name, self._namespace, lease))

    def _new_lease(self, now: datetime.datetime) -> client.V1Lease:
        return client.V1Lease(
            metadata=client.V1ObjectMeta(name=self._name, namespace=self._namespace),
            spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=self._duration_s,
                                    acquire_time=now, renew_time=now, lease_transitions=0),
        )

    @staticmethod
    def _write(call) -> bool:
        try:
            call()
        except ApiException as error:
            if error.status == _CONFLICT:
                return False
            raise
        return True
