"""``python -m elasticlab.cluster.torchrun``: see :mod:`elasticlab.cluster.torchrun.cli`."""
from elasticlab.cluster.torchrun.cli import exit_now, main

exit_now(main())
