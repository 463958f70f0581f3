"""`python -m jobs.demo --profile smoke|default|full` (`make demo`): the lifecycle demo of jobs/demo/driver.py."""
import sys

from jobs.demo.driver import main

sys.exit(main())
