"""Everything Ray: the cluster connection, placement groups, and worker groups of rank processes.

This is the only package of megarl that imports ray; the workers it hosts are plain classes.
"""
