"""gpufleet: the control plane and simulator of GPU clusters that serve LLM inference.

The package map (see docs/architecture.md):

* ``catalog``  GPU and model specs as data files with typed loaders
* ``perf``     memory arithmetic and the step-time model
* ``planner``  capacity plans (``gpufleet plan``)
* ``engine``   the replica model and the sim engine server
* ``fleet``    domain types shared by the control plane
* ``config``   the fleet file
* ``policy``   routing, admission, health, autoscaling (pure)
* ``control``  the pool controller: the control loop both shells drive (pure)
* ``gateway``  the OpenAI-compatible HTTP edge
* ``runtime``  where replicas run (local processes, Kubernetes)
* ``sim``      the fleet simulator
* ``store``    durable records
* ``cli``      the ``gpufleet`` command
"""

__version__ = "0.1.0"
