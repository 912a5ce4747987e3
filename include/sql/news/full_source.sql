SELECT id FROM news.posts WHERE status IS DISTINCT FROM 'Archived'
