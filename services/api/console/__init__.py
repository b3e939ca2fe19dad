"""The operators' web console under /console: server-rendered pages (Jinja2) served by the API
itself, with one small script of our own. Pages carry no data; the script fetches HTML fragments
with the bearer token in a header (kept in the browser's session storage), so the console has
exactly the API's tokens and tenancy and no cookie carries authority."""
