"""The admin dashboard: server-rendered pages for platform and organisation admins.

Mounted by the composition root (`tokenmill/app.py::create_app`) at `/dashboard` beside the
admin API; it calls the control plane's and billing's services, which hold the role rules
and write the audit log. Nothing else imports this package.
"""

PREFIX = "/dashboard"
